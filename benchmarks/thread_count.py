"""Does a run's outcome depend on torch's thread count? The released-code table's floor (the labeled site
alone, ``isofed_rscfed`` preset, 60 rounds, scored at 20, 40 and 60) on one split, trained once with one torch
thread and once with two, each in its own process: same code, split, settings and seed. The thread count sets
the order of floating-point sums; over many steps the runs part.

    python benchmarks/thread_count.py --data DIR [--seed 0]

DIR: a split of ``fedlabels prepare pneumoniamnist --protocol isofed --partition rscfed --labeled 1``. Writes
``benchmarks/results/thread_count.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "thread_count.md"
ROUNDS, EVAL = 60, "20,40,60"


def one(data: str, seed: int) -> dict:
    """The floor's test accuracy per eval round, in this process (its thread count: the caller's)."""
    import torch
    from fedlabels import bench
    from fedlabels.scoring import Scorer

    args = SimpleNamespace(data=data, bundle="medmnist_cnn", methods="isofed", seeds=str(seed), rounds=ROUNDS,
                           local_epochs=1, opt=None, eval_rounds=EVAL, engine="inprocess", synth=None,
                           batch_size=None, image_size=None, network=None, out=tempfile.mkdtemp(),
                           preset="isofed_rscfed")
    plan = bench.make_plan(args)
    bench.prepare_data(plan)
    scorer = Scorer(plan.bundle, plan.datasets[seed], plan.network, plan.config)
    out = bench.run_floor(plan, bench.Cell("local:site-1", seed, "site-1"), scorer, lambda m: None)
    acc = {r["round"]: r["value"] for r in out["rows"] if r["model"] == "last" and r["group"] == bench.POOLED
           and r["class"] == bench.MEAN and r["metric"] == "accuracy"}
    return {"threads": torch.get_num_threads(), "accuracy": acc}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child: one run, JSON on stdout
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.data, args.seed)))
        return
    runs = []
    for threads in (1, 2):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run([sys.executable, __file__, "--one", "--data", args.data, "--seed", str(args.seed)],
                              env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"[threads] {runs[-1]}", flush=True)
    rounds = sorted(runs[0]["accuracy"], key=int)
    lines = ["# A run's numbers and torch's thread count", "",
             f"The released-code table's floor (the labeled site alone, `isofed_rscfed` preset, {ROUNDS} rounds) on "
             f"`{Path(args.data).name}`, seed {args.seed}, trained twice in separate processes that differ only in "
             "torch's thread count (`python benchmarks/thread_count.py`). Test accuracy of the last model:", "",
             "| torch threads | " + " | ".join(f"round {r}" for r in rounds) + " |",
             "|---|" + "---|" * len(rounds)]
    lines += [f"| {run['threads']} | " + " | ".join(f"{100 * run['accuracy'][r]:.1f}" for r in rounds) + " |"
              for run in runs]
    tmp = OUT.with_name(f".{OUT.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(OUT)
    print(f"[threads] wrote {OUT}")


if __name__ == "__main__":
    main()
