"""What IsoFed's client-adaptive pretraining does to an unlabeled site (analysis only).

    python benchmarks/isofed_pretrain.py --data DIR [--rounds 20] [--probe-rounds 1,5,10,20] --out FILE.md

Runs ``isofed`` in process on a prepared ``isofed`` scenario and, at the probe
rounds, takes the global model the unlabeled sites receive. For each
unlabeled site it measures, against the site's oracle labels (never used in
training), the model's accuracy on the site's training cases and the
distance between its predicted class histogram and the site's true one, before
and after the site's pretraining step (``SemiSupClient.adapt``: one pass of
the information-maximisation loss, on a copy). The IM loss rewards a uniform
*predicted* class histogram; under a Dirichlet label split the true one is
far from uniform. This measures whether that is what pretraining does.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch


def histogram(net, loader, classes: int):
    """(accuracy on the oracle labels, predicted class fractions, true class fractions)."""
    net.eval()
    preds, labels = [], []
    with torch.no_grad():
        for b in loader:
            preds.append(net(b["image"]).argmax(1))
            labels.append(torch.as_tensor(b["label"]).view(-1))
    p, y = torch.cat(preds).numpy(), torch.cat(labels).numpy()
    return float((p == y).mean()), np.bincount(p, minlength=classes) / len(p), np.bincount(y, minlength=classes) / len(y)


def main(argv=None):
    from fedlabels import methods, references
    from fedlabels.bundle import bundle_path
    from fedlabels.methods.base import load_weights
    from fedlabels.site import setup_site

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--probe-rounds", default="1,5,10,20")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    probes = {int(r) for r in args.probe_rounds.split(",")}
    bundle = bundle_path("medmnist_cnn")
    setups = references.setups(bundle, args.data, seed=args.seed, method="isofed")
    unlabeled = [s for s, st in setups.items() if not st.summary()["labeled"]]
    # The same cases with their oracle labels (and the label-preserving training flips), for measuring only.
    oracle = {s: setup_site(bundle, args.data, s, seed=args.seed, oracle=True) for s in unlabeled}
    classes = len(next(iter(setups.values())).classes)
    rows = []

    def on_round(record, weights, best):
        r = record["round"] + 1
        if r not in probes:
            return
        for s in unlabeled:
            net = copy.deepcopy(setups[s].net)
            load_weights(net, weights)
            acc0, pred0, true = histogram(net, oracle[s].train_loader, classes)
            client = methods.get("isofed").make_client(net, setups[s].context(), lr=1e-3, epochs=1)
            client.receive(weights)
            client.ctx.reseed(10_000 + r)
            client.adapt()
            acc1, pred1, _ = histogram(client.net, oracle[s].train_loader, classes)
            tv = lambda a, b: 0.5 * float(np.abs(a - b).sum())  # noqa: E731
            rows.append({"round": r, "site": s, "acc_before": acc0, "acc_after": acc1,
                         "tv_pred_true_before": tv(pred0, true), "tv_pred_true_after": tv(pred1, true),
                         "tv_pred_uniform_before": tv(pred0, np.full(classes, 1 / classes)),
                         "tv_pred_uniform_after": tv(pred1, np.full(classes, 1 / classes)),
                         "tv_true_uniform": tv(true, np.full(classes, 1 / classes))})
            print(json.dumps(rows[-1]), flush=True)

    references.federate("isofed", setups, args.rounds, seed=args.seed, log=None, client_options={"lr": 1e-3},
                        on_round=on_round)
    lines = [f"# IsoFed pretraining on unlabeled sites: `{args.data}`, seed {args.seed}", "",
             "Global model received by each unlabeled site at the probe round, before and after one pass of "
             "the information-maximisation loss (the site's pretraining). Accuracy on the site's own training "
             "cases against their oracle labels (analysis only); TV = total-variation distance between class "
             "histograms (predicted vs the site's true one, predicted vs uniform).", "",
             "| round | site | acc before | acc after | TV(pred, true) before → after | TV(pred, uniform) before → after "
             "| TV(true, uniform) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['site']} | {r['acc_before']:.3f} | {r['acc_after']:.3f} | "
                     f"{r['tv_pred_true_before']:.3f} → {r['tv_pred_true_after']:.3f} | "
                     f"{r['tv_pred_uniform_before']:.3f} → {r['tv_pred_uniform_after']:.3f} | {r['tv_true_uniform']:.3f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
