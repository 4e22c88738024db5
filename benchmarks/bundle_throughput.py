"""Training throughput of each bundle: the bundle's own training path vs a plain PyTorch loop.

For every bundle in ``bundles/`` this builds the MONAI train workflow exactly as
``python -m monai.bundle run --config_file configs/train.json`` does
(``monai.bundle.ConfigWorkflow``: CacheDataset, ThreadDataLoader, random
augmentation, SupervisedTrainer with the bundle's handlers -- logging,
TensorBoard, checkpointing) and times ``train#trainer`` over a fixed number
of iterations after a warm-up. Side by side, in the same process and on the
same data, a plain PyTorch loop trains a fresh copy of the same network with
the same loss, optimizer and batch size on tensors that were preprocessed
once and kept in memory (no augmentation, no handlers): the floor any
framework overhead is measured against.

A second plain loop runs over the bundle's own DataLoader (same CacheDataset,
same augmentation): bundle / that loop is the cost of the bundle's engine
and handlers alone; bundle / in-memory loop also includes the data pipeline.

The three paths alternate in short blocks (in-memory, loader, bundle, ...) so
a machine shared with other jobs slows them alike; ratios are taken within
each block and the table reports their median over the repeats, by CPU time
of this process (stable under load, and conservative: augmentation done by
the loader's background thread still counts) and by wall-clock time, with the
best (least disturbed) throughput of each path.

    python benchmarks/bundle_throughput.py                 # all bundles, CPU sizes
    python benchmarks/bundle_throughput.py --bundles medmnist_cnn --iters 100

Writes ``benchmarks/results/bundle_throughput.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# bundle -> synthetic scenario and CPU-sized settings
SETUPS = {
    "cxr_densenet121": dict(family="cxr", gen=dict(size=64, cases=48, test_cases=8), image_size=64, batch=16, iters=8),
    "cxr_resnet18": dict(family="cxr", gen=dict(size=64, cases=48, test_cases=8), image_size=64, batch=16, iters=8),
    "medmnist_cnn": dict(family="medmnist", gen=dict(cases=1200, test_cases=8, labeled=[0, 1, 2, 3]), image_size=28,
                         batch=64, iters=60),
    "lesion_unet": dict(family="lesion", gen=dict(size=64, cases=48, test_cases=8, supervision=["pixel"] * 4),
                        image_size=64, batch=16, iters=8),
}


def bundle_workflow(name: str, data: Path, work: Path, setup: dict, total_iters: int, overrides: dict | None = None):
    from monai.bundle import ConfigWorkflow

    bundle = REPO / "bundles" / name
    wf = ConfigWorkflow(
        config_file=str(bundle / "configs" / "train.json"),
        meta_file=str(bundle / "configs" / "metadata.json"),
        logging_file=False,
        workflow_type="train",
        bundle_root=str(bundle),
        dataset_dir=str(data),
        site="",
        batch_size=setup["batch"],
        image_size=setup["image_size"],
        epochs=10**6,  # stopped after total_iters below
        val_interval=10**6,  # validation is not training throughput
        output_dir=str(work / "out"),
        ckpt_dir=str(work / "out" / "models"),
        **(overrides or {}),
    )
    wf.initialize()
    return wf


def time_bundle(wf, warmup: int, iters: int) -> tuple:
    """(wall, CPU) seconds for ``iters`` trainer iterations (data, step, handlers) after ``warmup``."""
    from ignite.engine import Events

    trainer = wf.trainer
    marks = {}

    def mark(engine):
        it = engine.state.iteration
        if it == warmup:
            marks["start"] = (time.perf_counter(), time.process_time())
        elif it == warmup + iters:
            marks["end"] = (time.perf_counter(), time.process_time())
            engine.terminate()

    handle = trainer.add_event_handler(Events.ITERATION_COMPLETED, mark)
    trainer.state.iteration = trainer.state.epoch = 0
    trainer.state.max_epochs = 10**6
    trainer.run()
    handle.remove()
    return marks["end"][0] - marks["start"][0], marks["end"][1] - marks["start"][1]


def plain_setup(wf, seed: int = 0):
    """Same network class/config, loss, optimizer; tensors preprocessed once, in memory."""
    from monai.transforms import Compose

    parser = wf.parser
    items = parser.get_parsed_content("train#datalist")
    det = Compose(parser.get_parsed_content("train#deterministic_transforms", lazy=False))
    data = [det(dict(i)) for i in items]
    x = torch.stack([torch.as_tensor(d["image"]) for d in data])
    y = torch.stack([torch.as_tensor(d["label"]) for d in data])
    torch.manual_seed(seed)
    net = parser.get_parsed_content("network_def", lazy=False).to(parser.get_parsed_content("device"))
    loss = parser.get_parsed_content("loss", lazy=False)
    lr = parser.get_parsed_content("lr")
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    return net, loss, opt, x, y


def time_loader(net, loss_fn, opt, loader, warmup: int, iters: int) -> tuple:
    """A plain loop over the bundle's own DataLoader (same dataset, cache and augmentation)."""
    device = next(net.parameters()).device
    net.train()
    start, it = None, 0
    while it < warmup + iters:
        for batch in loader:
            it += 1
            xb, yb = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(xb), yb)
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if it == warmup:
                start = (time.perf_counter(), time.process_time())
            if it == warmup + iters:
                break
    return time.perf_counter() - start[0], time.process_time() - start[1]


def time_plain(net, loss_fn, opt, x, y, batch: int, warmup: int, iters: int, seed: int = 0) -> tuple:
    device = next(net.parameters()).device
    g = torch.Generator().manual_seed(seed)
    net.train()
    order = torch.randperm(len(x), generator=g)
    pos = 0
    start = None
    for it in range(1, warmup + iters + 1):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(x), generator=g), 0
        idx = order[pos:pos + batch]
        pos += batch
        xb, yb = x[idx].to(device), y[idx].to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(xb), yb)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if it == warmup:
            start = (time.perf_counter(), time.process_time())
    return time.perf_counter() - start[0], time.process_time() - start[1]


def loadavg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", nargs="*", default=list(SETUPS))
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per repeat (default: per bundle)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine two OpenMP threads stall whenever "
                         "another process takes a core; use the core count on a dedicated machine)")
    ap.add_argument("--set", nargs="*", default=[], metavar="ID=VALUE",
                    help="bundle config overrides, e.g. num_workers=1 (values parsed as JSON when possible)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bundle_throughput.md"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value

    import monai

    from fedlabels.data.synthetic import generate

    rows = []
    load_before = loadavg()
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedlabels-bench-") as tmp:
        tmp = Path(tmp)
        scenarios = {}
        for name in args.bundles:
            setup = SETUPS[name]
            fam = setup["family"]
            key = (fam, tuple(sorted((k, str(v)) for k, v in setup["gen"].items())))
            if key not in scenarios:
                print(f"[{name}] generating the {fam} scenario ...", flush=True)
                scenarios[key] = generate(fam, tmp / f"{fam}-{len(scenarios)}", seed=0, **setup["gen"])
            data = scenarios[key]
            iters = args.iters or setup["iters"]
            batch = setup["batch"]
            print(f"[{name}] building the bundle's train workflow ...", flush=True)
            wf = bundle_workflow(name, data, tmp / name, setup, args.warmup + iters, overrides)
            net, loss_fn, opt, x, y = plain_setup(wf)
            n_train = len(x)
            loader = wf.parser.get_parsed_content("train#dataloader")
            plain_s, loader_s, bundle_s = [], [], []
            runs = [
                (plain_s, lambda r: time_plain(net, loss_fn, opt, x, y, batch, args.warmup, iters, seed=r)),
                (loader_s, lambda r: time_loader(net, loss_fn, opt, loader, args.warmup, iters)),
                (bundle_s, lambda r: time_bundle(wf, args.warmup, iters)),
            ]
            for r in range(args.repeats):
                for k in range(3):  # rotate the order each repeat: no path always runs first
                    store, fn = runs[(r + k) % 3]
                    store.append(fn(r))
                ips = [iters * batch / t[0] for t in (plain_s[-1], loader_s[-1], bundle_s[-1])]
                print(f"[{name}] repeat {r + 1}/{args.repeats}: images/s plain in-memory {ips[0]:.1f}, "
                      f"plain over bundle loader {ips[1]:.1f}, bundle {ips[2]:.1f}", flush=True)

            def ratio(ref, k):  # median over repeats of ref time / bundle time (k: 0 wall, 1 CPU)
                return statistics.median(a[k] / b[k] for a, b in zip(ref, bundle_s))

            rows.append(dict(
                name=name, size=setup["image_size"], batch=batch, iters=iters, n=n_train,
                plain=iters * batch / min(t[0] for t in plain_s), loader=iters * batch / min(t[0] for t in loader_s),
                bundle=iters * batch / min(t[0] for t in bundle_s),
                cpu_vs_plain=ratio(plain_s, 1), cpu_vs_loader=ratio(loader_s, 1),
                wall_vs_plain=ratio(plain_s, 0), wall_vs_loader=ratio(loader_s, 0),
            ))
    elapsed = time.perf_counter() - t_all

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        "# Bundle training throughput: bundle path vs plain PyTorch loop",
        "",
        "Generated by `python benchmarks/bundle_throughput.py`. Images/s over a fixed number of training",
        f"iterations after {args.warmup} warm-up iterations; throughput = best of {args.repeats} repeats (wall clock).",
        "Ratios = median over repeats of the ratio within a repeat (the three paths run back to back, in an order",
        "that rotates each repeat), by the",
        "process's CPU time (all its threads: stable on a shared machine, and conservative -- work a background",
        "thread overlaps with the step still counts) and by wall-clock time (what a dedicated machine sees).",
        "*Bundle* = `train#trainer` of `configs/train.json` built by `monai.bundle.ConfigWorkflow` (CacheDataset +",
        "ThreadDataLoader + random augmentation + SupervisedTrainer with the bundle's StatsHandler,",
        "TensorBoardStatsHandler, EpochSummary, CheckpointSaver). *Plain* = `zero_grad; loss(net(x), y).backward();",
        "step` on the same network, loss, optimizer and batch size, either over tensors preprocessed once and",
        "held in memory (no augmentation: the floor) or over the bundle's own DataLoader (same data, cache and",
        "augmentation: what the engine and handlers add).",
        "",
        "| bundle | input | batch | timed iters | train images | plain, in-memory (img/s) | "
        "plain, bundle's loader (img/s) | bundle (img/s) | bundle / plain in-memory, CPU time | "
        "bundle / plain same loader, CPU time | bundle / plain in-memory, wall | bundle / plain same loader, wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['size']} px | {r['batch']} | {r['iters']} | {r['n']} | {r['plain']:.1f} | "
                     f"{r['loader']:.1f} | {r['bundle']:.1f} | **{r['cpu_vs_plain']:.2f}x** | {r['cpu_vs_loader']:.2f}x | "
                     f"{r['wall_vs_plain']:.2f}x | {r['wall_vs_loader']:.2f}x |")
    lines += [
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, device {device}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} CPU thread(s)), MONAI {monai.__version__}, "
        f"Python {platform.python_version()}.",
        f"Bundle overrides: {overrides or 'none (the committed defaults)'}.",
        f"Load average before / after: {load_before} / {loadavg()} (anything above this benchmark's own load is other work on the machine).",
        f"Total benchmark time: {elapsed:.0f} s.",
        "",
    ]
    text = "\n".join(lines)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
