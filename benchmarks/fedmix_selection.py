"""What FedMix's dynamic selection keeps, scored against the masks the sites do not have (analysis only).

    python benchmarks/fedmix_selection.py --data DIR --out benchmarks/results/fedmix/selection-NAME.md \\
        [--rounds 100] [--every 10] [--seed 0]

Trains FedMix in-process as ``benchmarks/plans/fedmix-*.yaml`` does (same options) and, every ``--every``
rounds, takes the global F1 and F2 to every site without masks: on each training case (its
deterministic view, no augmentation) the refined pseudo labels and the selection decision,
and the Dice of F1's refined pseudo label against the case's oracle mask, for the kept cases
and for the rejected ones. The training itself never sees the oracle masks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedlabels import references  # noqa: E402
from fedlabels.bundle import data as bundle_data  # noqa: E402
from fedlabels.bundle import read  # noqa: E402
from fedlabels.methods.fedmix import dice_agreement, refine, select  # noqa: E402
from fedlabels.nets import rebuild  # noqa: E402


def site_cases(setup, bundle, data, size):
    """(image, weak label, level, oracle mask) of the site's training cases, deterministic view."""
    parser = read(bundle, data, class_names=list(setup.classes), image_size=size)
    tf = parser.get_parsed_content("validate#preprocessing", instantiate=True)
    xs, labels, levels, masks = [], [], [], []
    for item, oracle in zip(setup.site.training, setup.site.oracle()["training"]):
        d = tf(bundle_data.bundle_item(item, setup.task, labeled_only=False))
        xs.append(torch.as_tensor(d["image"]))
        labels.append(torch.as_tensor(d["label"]))
        levels.append(d["level"])
        masks.append(torch.as_tensor(tf({"image": oracle["image"], "label": oracle["seg"]})["label"]))
    return torch.stack(xs), torch.stack(labels), torch.tensor(levels), torch.stack(masks)


@torch.no_grad()
def score(net, cases, epsilon=0.9):
    x, label, level, mask = cases
    p1 = (torch.sigmoid(net.f1(x)) > 0.5).float()
    p2 = (torch.sigmoid(net.f2(x)) > 0.5).float()
    r1, r2 = refine(p1, label, level), refine(p2, label, level)
    keep = select(r1, r2, label, level, epsilon)
    d = dice_agreement(r1, mask)
    lesion = mask.flatten(1).sum(1) > 0   # lesion-free cases agree trivially (two empty masks): kept apart
    area = r1.flatten(1).sum(1) / mask.flatten(1).sum(1).clamp(min=1)
    mean = lambda v: float(v.mean()) if len(v) else None  # noqa: E731
    return {"kept": float(keep.float().mean()), "kept_lesion": mean(keep[lesion].float()),
            "dice_kept": mean(d[keep & lesion]), "dice_rejected": mean(d[~keep & lesion]),
            "area_kept": mean(area[keep & lesion]), "area_rejected": mean(area[~keep & lesion]),
            "dice_all": mean(d[lesion])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    bundle = "lesion_unet"
    config = {"image_size": args.image_size}
    setups = references.setups(bundle, args.data, batch_size=16, seed=args.seed, method="fedmix", config=config)
    weak = {s: st for s, st in setups.items() if st.profile.supervision != "pixel"}
    cases = {s: site_cases(st, bundle, args.data, args.image_size) for s, st in weak.items()}
    net = rebuild(next(iter(setups.values())).net)  # a TwinUNet to load each round's global weights into
    rows = []
    fill = {}
    for s, (x, label, level, mask) in cases.items():
        boxed = (level == 1) & (label.flatten(1).sum(1) > 0)
        if boxed.any():  # how much of its box a lesion fills: the box rule asks dice(F1's label, box) >= 0.5
            fill[s] = (mask[boxed].flatten(1).sum(1) / label[boxed].flatten(1).sum(1)).numpy()

    def on_round(record, weights, best):
        r = record["round"] + 1
        if r % args.every and r != 1:
            return
        net.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        for s in weak:
            rows.append((r, s, weak[s].profile.supervision, score(net, cases[s]),
                         record["sites"].get(s, {}).get("kept_fraction")))
        print(f"round {r}: " + "; ".join(f"{row[1]} {row[3]}" for row in rows[-len(weak):]), flush=True)

    t0 = time.time()
    references.federate("fedmix", setups, args.rounds, seed=args.seed, log=None, on_round=on_round,
                        client_options={"lr": 1e-3, "weight_decay": 1e-4}, server_options={"beta": 3})
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"# What FedMix's selection keeps: {args.data.name}, seed {args.seed}", "",
             f"`python benchmarks/fedmix_selection.py --data {args.data} --rounds {args.rounds} --every {args.every} "
             f"--seed {args.seed}` ({time.time() - t0:.0f} s). After round r, the global F1 and F2 on each site's "
             "training cases (deterministic view): the fraction the selection keeps, and the Dice of F1's refined "
             "pseudo label against the oracle mask for kept and rejected cases with a lesion (lesion-free cases "
             "agree trivially and are left out of the Dice and area columns), and the area of that pseudo label "
             "over the lesion's (above 1: larger than the lesion). `kept in training` is the fraction the site "
             "kept during round r itself (augmented views).", "",
             *[f"Boxes at {s}: the lesion fills {np.mean(f):.2f} of its box on average (median {np.median(f):.2f}); "
               f"{np.mean(f >= 1 / 3):.2f} of the boxes are at least a third full, the fill at which a perfect "
               "pseudo label reaches dice 0.5 with its box." for s, f in fill.items()], "",
             "| round | site | supervision | kept (all) | kept (lesion cases) | Dice kept | Dice rejected | "
             "Dice all | area kept | area rejected | kept in training |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, s, sup, sc, k in rows:
        lines.append(f"| {r} | {s} | {sup} | {sc['kept']:.2f} | {fmt(sc['kept_lesion'])} | {fmt(sc['dice_kept'])} | "
                     f"{fmt(sc['dice_rejected'])} | {fmt(sc['dice_all'])} | {fmt(sc['area_kept'])} | "
                     f"{fmt(sc['area_rejected'])} | {fmt(k)} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
