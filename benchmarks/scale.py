"""Many simulated hospitals on one machine: memory, time, CPU, bytes and start-up per number of sites.

One row per number of sites N (default 4, 8, 16, 32), each a synthetic cxr
scenario from ``fedlabels synth cxr --sites N`` (site k labels like FedPSL
Table I's site k mod 4), job ``fedavg_pl_cxr`` (DenseNet121, 64 px), the same
rounds and options in every run. Side by side in each row:

* **plain**: the same sites, rule and local steps in one process
  (``references.federate`` plus the validation passes a FLARE site runs), the
  CPU reference;
* **FLARE float32**: ``nvflare simulator`` through ``fedlabels.flare.simulator.simulate``
  with ``default_threads(N)`` worker processes (one per site while they fit in
  memory, else one per core with the sites taking turns): peak total RSS of
  the whole process tree (sampled every 0.5 s), seconds and CPU-seconds per
  steady round, start-up (launch to the controller's first round), bytes each
  site uploads per round (nvflare's download-service log);
* **FLARE float16**: the same with ``transfer=float16`` (nvflare's
  quantization filters both ways): bytes per round.

Two further sections: at 8 sites, 8 worker processes against 2 (the sites
taking turns, a new process per site task): what a turn costs per task; and
4 sites, ``--seeds`` seeds, float16 against float32: the final global model's
test AUROC, the difference against the seed-to-seed spread.

    python benchmarks/scale.py                     # everything (~50 min on 2 cores)
    python benchmarks/scale.py --sites 4 --quick   # smoke test

Resumable: each finished cell is kept in ``OUT/scale.json`` and skipped when
the command runs again. Writes ``OUT/scale.md``, ``OUT/scale.json`` and
``OUT/scale.png`` (default OUT: benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flare_overhead as fo  # noqa: E402  (the process-tree sampler, the plain loop, the simulator runner)

REPO = Path(__file__).resolve().parents[1]
JOB = "fedavg_pl_cxr"
MIB = 2**20
FIRST_ROUND = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* - method \S+ client .*; rounds (\d+)\.\.", re.M)


def started_training(ws: Path) -> float | None:
    """When the controller began round 0 (after every site set up and answered the handshake)."""
    m = FIRST_ROUND.search((Path(ws) / "server" / "log.txt").read_text(errors="replace"))
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def flare_cell(work, data, rounds, sites, threads, tag, options, **changes) -> dict:
    r = fo.run_flare(work, data, rounds, sites, threads, tag, job=JOB, sampler_options={"interval": 0.5, "pss": False},
                     client=options, **changes)
    first = started_training(Path(r["ws"]))
    ups = [n for t in r["transfers"].values() for n in t["up"]]
    mem = r["memory"]
    return {"sites": sites, "threads": threads, "rounds_s": r["rounds_s"], "rounds_cpu_s": r["rounds_cpu_s"],
            "wall_s": r["wall_s"], "startup_s": None if first is None else first - r["started"],
            "peak_total_rss_mib": mem["peak_total_rss"] / MIB, "processes_at_peak": mem["processes_at_peak"],
            "worker_peak_rss_mib": None if mem["worker_peak_rss_max"] is None else mem["worker_peak_rss_max"] / MIB,
            "worker_peak_rss_mean_mib": None if mem["worker_peak_rss_mean"] is None else mem["worker_peak_rss_mean"] / MIB,
            "server_side_rss_at_peak_mib": (mem["server_side_rss_at_peak"] or 0) / MIB,
            "worker_processes": mem["worker_processes"], "site_setups": r["site_setups"],
            "upload_bytes": ups, "cpu_seconds": mem["cpu_seconds"], "load_mean": mem["load_mean"]}


def plain_cell(work, data, rounds, sites, options, tag) -> dict:
    p = fo.run_plain(work, data, rounds, [f"site-{k + 1}" for k in range(sites)], options, measure_bytes_=True, tag=tag)
    cpu = [t + v for t, v in zip(p["train_rounds_cpu_s"], p["val_round_cpu_s"])]
    wall = [t + v for t, v in zip(p["train_rounds_s"], p["val_round_s"])]
    return {"rounds_cpu_s": cpu, "rounds_s": wall, "peak_rss_mib": p["memory"]["peak_total_rss"] / MIB,
            "model_bytes": p["bytes"]["torch_save"], "update_fobs": p["bytes"]["update_fobs"]}


def cpu_section(work, data, rounds, options) -> dict:
    """CPU-s per steady round for the same local steps, 4 sites, three ways: one process
    training the sites in turn; four processes, one site each, at once (the concurrency
    of the simulator, without FLARE); and the simulator with a process per site. The
    first two differ only in concurrency, the last two only in FLARE."""
    from concurrent.futures import ThreadPoolExecutor

    print("[cpu] one process, 4 sites in turn ...", flush=True)
    one = plain_cell(work, data, rounds, 4, options, "cpu-one")
    print("[cpu] four processes at once, one site each ...", flush=True)

    def single(k):
        p = fo.run_plain(work, data, rounds, [f"site-{k + 1}"], options, tag=f"cpu-four-{k + 1}")
        return [t + v for t, v in zip(p["train_rounds_cpu_s"], p["val_round_cpu_s"])]

    with ThreadPoolExecutor(4) as pool:
        four = list(pool.map(single, range(4)))
    print("[cpu] FLARE simulator, 4 worker processes ...", flush=True)
    flare = flare_cell(work, data, rounds, 4, 4, "cpu-flare", options)
    return {"one": one["rounds_cpu_s"], "four": [sum(r) for r in zip(*four)], "flare": flare["rounds_cpu_s"],
            "flare_rounds_s": flare["rounds_s"], "one_rounds_s": one["rounds_s"]}


def test_auroc(run_dir, data) -> float:
    from fedlabels.flare.commands import evaluate_global

    return evaluate_global(run_dir, REPO / "bundles" / "cxr_densenet121", data, "last")["auroc"]


def steady(values):
    values = [v for v in values[1:] if v is not None]
    return statistics.mean(values) if values else None


def fmt(v, spec=".1f"):
    return "n/a" if v is None else f"{v:{spec}}"


def report(res: dict) -> str:
    cfg = res["config"]
    rows = [res["rows"][k] for k in sorted(res["rows"], key=int)]
    lines = [
        "# Scale: many simulated sites on one machine",
        "",
        f"Generated by `{res['command']}` on {res['date']}. Job `{JOB}` (DenseNet121, 64 px input, FedAvg with "
        f"annotated-class loss), synthetic cxr scenarios from `fedlabels synth cxr --sites N --cases {cfg['cases']} "
        f"--size {cfg['size']}`, {cfg['rounds']} rounds, options {cfg['options']}, {cfg['torch_threads']} torch thread(s) "
        "in every process (`OMP_NUM_THREADS`; what the controller gives a simulated site on 2 cores). Each row's runs are back to back on an otherwise idle "
        "machine. *Steady round* = mean of rounds 1.. (round 0 includes start-up). *Peak RSS* = peak of the summed "
        "RSS of every process of the run (sampled every 0.5 s; RSS counts shared library pages once per process, so "
        "it overstates what the processes need together).",
        "",
        "| sites | worker processes | peak RSS, whole run (MiB) | largest site process (MiB) | simulator's own processes at the peak (MiB) "
        "| start-up to round 0 (s) | steady round (s) | CPU-s per steady round, FLARE | CPU-s per steady round, in-process "
        "| **CPU ratio** | bytes a site uploads per round, float32 | float16 | **ratio** |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, p, h = r["flare"], r["plain"], r.get("half")
        cpu_f, cpu_p = steady(f["rounds_cpu_s"]), steady(p["rounds_cpu_s"])
        up_f = statistics.mean(f["upload_bytes"]) if f["upload_bytes"] else None
        up_h = statistics.mean(h["upload_bytes"]) if h and h["upload_bytes"] else None
        lines.append(
            f"| {f['sites']} | {f['threads']}" + (" (sites take turns)" if f["threads"] < f["sites"] else "")
            + f" | {f['peak_total_rss_mib']:,.0f} | {fmt(f['worker_peak_rss_mib'], ',.0f')} | {f['server_side_rss_at_peak_mib']:,.0f} "
            f"| {fmt(f['startup_s'])} | {fmt(steady(f['rounds_s']))} | {fmt(cpu_f)} | {fmt(cpu_p)} "
            f"| **{fmt(None if not cpu_p or cpu_f is None else cpu_f / cpu_p, '.2f')}x** | {fmt(up_f, ',.0f')} | {fmt(up_h, ',.0f')} "
            f"| **{fmt(None if not up_f or up_h is None else up_h / up_f, '.3f')}x** |")
    model = rows[0]["plain"]["model_bytes"] if rows else None
    lines += ["", f"The model file (`torch.save` of the state dict) is {fmt(model, ',.0f')} bytes."]
    turns = res.get("turns")
    if turns:
        a, b = turns["own"], turns["turns"]
        per_task = None
        tasks = b["site_setups"] - a["site_setups"]
        if tasks > 0:
            per_task = (b["cpu_seconds"] - a["cpu_seconds"]) / tasks
        lines += [
            "",
            f"## Sites taking turns ({a['sites']} sites)",
            "",
            "With fewer simulator threads than sites, nvflare starts a new worker process for every site task; the site "
            "sets itself up again (imports, network, data cache) and continues the state it saved after its last round "
            "(`fedlabels.flare.client`; without this its optimizer and local state would restart every round).",
            "",
            "| worker processes | site set-ups | peak RSS (MiB) | steady round (s) | CPU-s, whole run | wall, whole run (s) |",
            "|---|---|---|---|---|---|",
        ]
        for x in (a, b):
            lines.append(f"| {x['threads']} | {x['site_setups']} | {x['peak_total_rss_mib']:,.0f} | {fmt(steady(x['rounds_s']))} "
                         f"| {x['cpu_seconds']:.0f} | {x['wall_s']:.0f} |")
        lines += ["", f"Each extra set-up costs about {fmt(per_task)} CPU-s "
                      f"((CPU-s difference) / (extra set-ups: {tasks})), against "
                      f"{fmt(a['peak_total_rss_mib'] - b['peak_total_rss_mib'], ',.0f')} MiB less peak memory."]
    c = res.get("cpu")
    if c:
        one, four, flare = steady(c["one"]), steady(c["four"]), steady(c["flare"])
        lines += ["", "## Where FLARE's extra CPU goes (4 sites)", "",
                  f"The same local steps (4 sites, {cfg['cpu_cases']} cases of a reference site), CPU-s per steady round "
                  "of the whole process tree (training + the validation of the received model a FLARE site runs):", "",
                  "| run | CPU-s per steady round | ratio |", "|---|---|---|",
                  f"| one process, the sites in turn (`references.federate`) | {fmt(one, '.2f')} | 1.00x |",
                  f"| four processes at once, one site each (no FLARE) | {fmt(four, '.2f')} | {fmt(four / one if one else None, '.2f')}x |",
                  f"| FLARE simulator, a process per site | {fmt(flare, '.2f')} | {fmt(flare / one if one else None, '.2f')}x "
                  f"({fmt(flare / four if four else None, '.2f')}x the four processes) |"]
    seeds = res.get("seeds")
    if seeds:
        lines += ["", "## Half precision against full precision (final test AUROC)", "",
                  f"4 sites, {cfg['seed_rounds']} rounds, the last global model on the scenario's test split; "
                  "the scenario is drawn anew with each seed (`--seed` of `fedlabels synth`).", "",
                  "| seed | float32 | float16 | difference |", "|---|---|---|---|"]
        diffs = []
        for s in sorted(seeds, key=int):
            a, b = seeds[s]["float32"], seeds[s]["float16"]
            diffs.append(b - a)
            lines.append(f"| {s} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
        f32 = [seeds[s]["float32"] for s in seeds]
        if len(seeds) > 1:
            lines += ["", f"Mean difference {statistics.mean(diffs):+.4f} (sd {statistics.stdev(diffs):.4f}); "
                          f"seed-to-seed sd of float32 {statistics.stdev(f32):.4f}."]
    lines += ["", "## Machine", "",
              f"{platform.machine()}, {os.cpu_count()} CPU cores, {res['memory_gib']:.1f} GiB memory, no GPU, "
              f"torch {res['versions']['torch']}, nvflare {res['versions']['nvflare']}, MONAI {res['versions']['monai']}; "
              f"load average before {res['load_before']}. Total benchmark time: {res.get('total_s', 0) / 60:.0f} min."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [res["rows"][k] for k in sorted(res["rows"], key=int)]
    n = [r["flare"]["sites"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(n, [r["flare"]["peak_total_rss_mib"] / 1024 for r in rows], "o-", label="FLARE simulator")
    a.plot(n, [r["plain"]["peak_rss_mib"] / 1024 for r in rows], "s--", label="in-process loop")
    a.axhline(res["memory_gib"], color="grey", lw=0.8, ls=":", label="machine memory")
    a.set(xlabel="sites", ylabel="peak RSS (GiB)", xticks=n, title="memory")
    a.legend(fontsize=8)
    b.plot(n, [steady(r["flare"]["rounds_s"]) for r in rows], "o-", label="FLARE simulator")
    b.plot(n, [steady(r["plain"]["rounds_s"]) for r in rows], "s--", label="in-process loop")
    b.set(xlabel="sites", ylabel="seconds per steady round", xticks=n, title="time")
    b.legend(fontsize=8)
    for x, r in zip(n, rows):
        if r["flare"]["threads"] < r["flare"]["sites"]:
            a.annotate(f"{r['flare']['threads']} processes,\nsites take turns", (x, r["flare"]["peak_total_rss_mib"] / 1024),
                       fontsize=7, ha="right", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="4,8,16,32", help="comma-separated numbers of sites, one row each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", type=int, default=8, help="cases of a reference site (Table I's site-1 size)")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the float16 vs float32 comparison (0: skip it)")
    ap.add_argument("--seed-rounds", type=int, default=8)
    ap.add_argument("--seed-cases", type=int, default=40)
    ap.add_argument("--no-turns", action="store_true", help="skip the sites-taking-turns comparison")
    ap.add_argument("--cpu-cases", type=int, default=150,
                    help="reference-site cases of the CPU comparison (4 sites; 0: skip it)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 rounds, 1 seed, no turns comparison")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for scale.md/.json/.png")
    ap.add_argument("--work", default="/tmp/fedlabels-scale", help="workspaces and logs")
    args = ap.parse_args(argv)
    # One torch thread in every process, in-process loop and simulated sites alike: what the
    # controller gives a simulated site here (2 cores, 2 or more sites), so runs differ in one thing.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.torch_threads)
    if args.quick:
        args.rounds, args.seeds, args.seed_rounds, args.no_turns, args.cpu_cases = 2, 1, 2, True, 0

    import monai
    import nvflare
    import psutil
    import torch

    from fedlabels.data.synthetic import generate
    from fedlabels.flare.simulator import default_threads
    from fedlabels.profile import write_json_atomic

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    store = out / "scale.json"
    options = {"lr": 1e-3, "epochs": 1}
    config = {"rounds": args.rounds, "cases": args.cases, "size": args.size, "options": options,
              "seed_rounds": args.seed_rounds, "seed_cases": args.seed_cases, "cpu_cases": args.cpu_cases,
              "torch_threads": args.torch_threads}
    res = json.loads(store.read_text()) if store.is_file() else {}
    if res.get("config") != config:
        res = {"config": config, "rows": {}}  # other settings: start over
    res.update(command="python benchmarks/scale.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
               date=time.strftime("%Y-%m-%d %H:%M"), load_before=fo.loadavg(),
               memory_gib=psutil.virtual_memory().total / 2**30,
               versions={"torch": torch.__version__, "nvflare": nvflare.__version__, "monai": monai.__version__})
    t_all = time.time() - res.get("total_s", 0)

    def save():
        res["total_s"] = time.time() - t_all
        write_json_atomic(store, res)

    def data_for(n, seed=0, cases=args.cases):
        root = work / f"data-{n}-seed{seed}-{cases}"
        if not (root / "scenario.yaml").is_file():
            generate("cxr", root, seed=seed, cases=cases, test_cases=40, size=args.size, sites=n)
        return root

    for n in [int(x) for x in args.sites.split(",")]:
        row = res["rows"].setdefault(str(n), {})
        data = data_for(n)
        threads = default_threads(n)
        for cell, run in (("plain", lambda: plain_cell(work, data, args.rounds, n, options, f"plain-{n}")),
                          ("flare", lambda: flare_cell(work, data, args.rounds, n, threads, f"f32-{n}", options)),
                          ("half", lambda: flare_cell(work, data, args.rounds, n, threads, f"f16-{n}", options,
                                                      transfer="float16"))):
            if cell in row:
                continue
            print(f"[{n} sites] {cell} ...", flush=True)
            t0 = time.time()
            row[cell] = run()
            print(f"[{n} sites] {cell} done in {time.time() - t0:.0f}s", flush=True)
            save()
    if not args.no_turns and "turns" not in res:
        data = data_for(8)
        print("[turns] 8 sites in 8 processes and in 2 ...", flush=True)
        res["turns"] = {"own": flare_cell(work, data, args.rounds, 8, 8, "own-8", options),
                        "turns": flare_cell(work, data, args.rounds, 8, 2, "turns-8", options)}
        save()
    if args.cpu_cases and "cpu" not in res:
        res["cpu"] = cpu_section(work, data_for(4, 0, args.cpu_cases), args.rounds, options)
        save()
    seeds = res.setdefault("seeds", {})
    for seed in range(args.seeds):
        cell = seeds.setdefault(str(seed), {})
        data = data_for(4, seed, args.seed_cases)
        for transfer in ("float32", "float16"):
            if transfer in cell:
                continue
            print(f"[seed {seed}] {transfer} ...", flush=True)
            r = fo.run_flare(work, data, args.seed_rounds, 4, 4, f"seed{seed}-{transfer}", job=JOB,
                             sampler_options={"interval": 1.0, "pss": False}, client=options, seed=seed, transfer=transfer)
            cell[transfer] = test_auroc(Path(r["ws"]) / "server" / "simulate_job", data)
            save()
    text = report(res)
    (out / "scale.md").write_text(text)
    plot(res, out / "scale.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
