"""How long a BloodMNIST IsoFed run takes on this machine, and where a round's time goes.

One process, one prepared split (4 sites, 1 labeled), the in-process round
engine (``references.federate``, the arithmetic a FLARE job runs):

* **setup** -- every site's ``setup_site`` (read the images, run the bundle's
  deterministic transforms once into the cache, build the network);
* **rounds** -- ``--rounds`` rounds of ``--method`` (default ``isofed``, 100
  rounds: the issue's target), the wall time of each;
* **data only** -- after the run, each site's training loader iterated the
  way the method's client draws from it in a round (weak and strong views on
  unlabeled sites, plus IsoFed's weak-only pretraining pass), nothing else:
  the share of a round spent fetching cached cases and running the random
  augmentations. Interleaved with extra rounds of the method so a drift of the
  machine's speed hits both;
* **loaders** -- the same rounds with the training loaders swapped, interleaved
  round by round: MONAI's ``DataLoader`` in process (what sites use), MONAI's
  ``ThreadDataLoader`` (augmentation in a background thread, overlapping the
  training step) and ``DataLoader(num_workers=1)`` (a worker process per pass).

    python benchmarks/tables.py benchmarks/plans/isofed-preset.yaml   # prepares the splits under its out/data
    python benchmarks/isofed_speed.py --data benchmarks/results/isofed-preset/data/bloodmnist-g0.8-l1-s0

Writes ``benchmarks/results/isofed_speed.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from monai.data import DataLoader, ThreadDataLoader

from fedlabels import methods, references

LOADERS = {
    "DataLoader (in process)": lambda ds, tl: DataLoader(ds, num_workers=0, **tl),
    "ThreadDataLoader": lambda ds, tl: ThreadDataLoader(ds, num_workers=0, **tl),
    "DataLoader, 1 worker process": lambda ds, tl: DataLoader(ds, num_workers=1 if len(ds) else 0, **tl),
}


def data_pass_seconds(setups: dict, pretrain: bool) -> float:
    """One round's draws from every site's training loader, no training."""
    t0 = time.perf_counter()
    for st in setups.values():
        loader = st.train_loader
        labeled = bool(st.summary()["labeled"])
        ds = loader.dataset
        passes = [False] if labeled else ([False, True] if pretrain else [True])
        for strong in passes:
            if hasattr(ds, "strong_on"):
                ds.strong_on = strong
            for _ in loader:
                pass
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a prepared isofed split (benchmarks/plans/isofed-preset.yaml)")
    p.add_argument("--method", default="isofed")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="data-only passes, each beside one more round")
    p.add_argument("--out", default="benchmarks/results/isofed_speed.md")
    args = p.parse_args(argv)

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    setups = references.setups("medmnist_cnn", args.data, seed=0, method=args.method)
    setup_s = time.perf_counter() - t0
    cases = {s: len(st.train_loader.dataset) for s, st in setups.items()}
    print(f"setup {setup_s:.1f}s; training cases {cases}", flush=True)

    t0 = time.perf_counter()
    out = references.federate(args.method, setups, rounds=args.rounds, seed=0,
                              log=lambda m: print(m, flush=True) if "round" in m else None)
    run_s = time.perf_counter() - t0
    rounds = np.array([r["seconds"] for r in out["records"]])

    pretrain = bool(methods.get(args.method).client_options().get("pretrain", False))
    data_s, round_s = [], []
    for _ in range(args.repeats):
        data_s.append(data_pass_seconds(setups, pretrain))
        extra = references.federate(args.method, setups, rounds=1, seed=1, log=None)
        round_s.append(extra["records"][0]["seconds"])
    share = np.array(data_s) / np.array(round_s)

    original = {s: st.train_loader for s, st in setups.items()}
    per_loader = {name: [] for name in LOADERS}
    for rep in range(args.repeats):
        for name, make in LOADERS.items():
            for s, st in setups.items():
                tl = original[s]
                st.train_loader = make(tl.dataset, dict(batch_size=tl.batch_size, shuffle=len(tl.dataset) > 0,
                                                        generator=tl.generator))
            rec = references.federate(args.method, setups, rounds=1, seed=2 + rep, log=None)["records"][0]
            per_loader[name].append(rec["seconds"])
    for s, st in setups.items():
        st.train_loader = original[s]
    base = np.median(per_loader[next(iter(LOADERS))])
    load1 = os.getloadavg()[0]

    lines = [
        f"# {args.method} on {Path(args.data).name}: wall time of a {args.rounds}-round run and a round's data share",
        "",
        f"`python benchmarks/isofed_speed.py --data {args.data} --method {args.method} --rounds {args.rounds}`; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), load average {load0:.2f} at start, {load1:.2f} at end.",
        "",
        f"- training cases per site: {cases}",
        f"- setup (cache the deterministic transforms, build networks): {setup_s:.1f} s",
        f"- {args.rounds} rounds: {run_s:.1f} s ({run_s / 60:.1f} min); per round median {np.median(rounds):.2f} s, "
        f"min {rounds.min():.2f} s, max {rounds.max():.2f} s",
        f"- setup + rounds: {(setup_s + run_s) / 60:.1f} min",
        f"- a round's draws from the training loaders alone (cached cases + random augmentation, no training), "
        f"beside a round of the method, {args.repeats} times: "
        + ", ".join(f"{d:.2f} s / {r:.2f} s" for d, r in zip(data_s, round_s))
        + f" -> data share {share.mean():.2f} (min {share.min():.2f}, max {share.max():.2f})",
        "",
        f"Training loaders compared, rounds interleaved ({args.repeats} each):",
        "",
        "| training loader | round (median) | vs in process |",
        "|---|---|---|",
        *[f"| {name} | {np.median(v):.2f} s | {np.median(v) / base:.2f}x |" for name, v in per_loader.items()],
        "",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(args.out) + ".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
